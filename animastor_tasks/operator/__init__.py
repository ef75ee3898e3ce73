"""The operator's interface: the `animastor-tasks` CLI, what it renders, the metrics exporter."""
