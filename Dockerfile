# Image for the example: celery-duraflow installed from this repository, plus the
# example_project package, which runs from /app. Used by docker-compose.yml for the
# `worker`, `sweeper`, `web` and `demo` services.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app

# The library with its web view (psycopg's binary wheel needs no system packages) and
# Celery's Redis transport.
COPY pyproject.toml README.md LICENSE ./
COPY celery_duraflow ./celery_duraflow
RUN pip install ".[web]" "celery[redis]"

# The example is not part of the distribution: it is imported from /app.
COPY example_project ./example_project

RUN useradd --create-home --uid 10001 duraflow
USER duraflow

CMD ["celery", "-A", "example_project.app", "worker", "--loglevel=INFO", "--concurrency=2"]
