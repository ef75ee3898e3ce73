"""The Celery side: the app and its start-up checks, its configuration, the public tasks, the
presence bootstep, and the wiring that builds one process's adapters."""
