"""The process around the engine: composition root and lifecycle (``daemon``), the command
line, configuration, the HTTP endpoint, the metric set and the observers that feed it,
sd_notify and logging. Only ``daemon`` sees the whole configuration."""
