"""An app whose rows atomic steps write with the Django ORM."""
