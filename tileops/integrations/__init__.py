"""Integrations of the tileops ops into other libraries (``tileops.integrations.transformers``)."""
