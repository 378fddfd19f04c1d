"""Tools that check the worker, not parts of it: nothing in the serving path imports them."""
