"""Postgres, the durable truth: one module per aggregate (catalog, commands, assets, jobs), the
journal every change writes through, and the reads operators ask for."""
