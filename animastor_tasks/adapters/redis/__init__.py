"""Redis, coordination that can be rebuilt from Postgres: one store per role sharing one
connection (`connection.py`), the Lua scripts in `lua/`."""
