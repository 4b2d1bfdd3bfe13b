"""The catalog: where model cards come from. Built-in TOML cards, cards derived from
the config.json of models in the models dirs, and the cache a node serves them from.

A layer beside routing and engine: it imports only exo.shared."""
