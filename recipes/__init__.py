"""`hy3c.recipes` (the top-level folder `recipes/`): the shipped compile recipes, YAML package data read by `hy3c.recipe`."""
