"""The configuration's sections, one pydantic model each, grouped by what they configure;
``service/schema.py`` assembles them into the whole ``Config``."""
