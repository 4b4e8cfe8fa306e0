"""A flight-booking agent that survives retries: the celery-duraflow example.

An agent loop asks a planner (a scripted stand-in for a language model) which
tool to call next: search flights, pick the best, book it, e-mail the user.
Before it books, the agent waits for a person to approve (a signal sent with
``send_signal`` or ``celery -A example_project.app duraflow signal``), holding
no worker meanwhile. The mailer fails the first time, Celery retries the task,
and the question is how often the card gets charged.

Modules:

* :mod:`example_project.app`: the Celery app (``celery -A example_project.app worker``);
* :mod:`example_project.tasks`: the agent, durable (``book_trip``) and naive
  (``book_trip_naive``);
* :mod:`example_project.planner`: the ``decide(history) -> action`` interface
  and the scripted planner, with notes on plugging in a real model, and the
  approval signal's name and payload;
* :mod:`example_project.services`: the fake airline (whose ledger records each
  charge) and the flaky mailer;
* :mod:`example_project.journal` and :mod:`example_project.db`: the trace of
  each attempt and the example's tables;
* :mod:`example_project.demo`: ``python -m example_project``.
"""
