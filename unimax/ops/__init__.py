"""Pure functions, state in -> state out: a torch reference beside every fast kernel."""
