"""The SQL store: models and keyword-only query functions. All SQL lives in this package."""
