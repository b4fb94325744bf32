"""Tools that use the models: the memory estimator, pairing, result tables and the CLI. They sit
above the models (and the core below both), so the core never imports a model."""
