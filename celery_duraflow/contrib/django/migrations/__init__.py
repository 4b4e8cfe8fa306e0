"""The Django migrations of the store's schema (see ``.._migrate``)."""
