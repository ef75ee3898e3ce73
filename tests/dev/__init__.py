"""Tests of the development tooling in animastor_tasks.dev: the local stores and the demo."""
