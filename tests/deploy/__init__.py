"""Deployment tests (marker `deploy`): the compose stack on a real Docker engine, and installs from a built wheel."""
