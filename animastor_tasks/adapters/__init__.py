"""The world behind the ports: Postgres, Redis, the Celery publisher, the broker probe and the
artifact store. Driver errors become `StoreUnavailable` here, at the edge."""
