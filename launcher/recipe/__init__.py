"""Recipes, read in either process: the schema, loading and overrides, the settings derived from
them, the validation rules and the cluster's environment. No torch here: `ls`, `show` and
`validate` stay fast."""
