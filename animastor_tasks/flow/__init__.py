"""The path of a command, top to bottom: regenerate -> gate -> dispatch -> generate; cancel;
reconcile; status. Flows import the domain and the ports only (checked by lint-imports)."""
