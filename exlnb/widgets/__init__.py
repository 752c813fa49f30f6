"""What a researcher sees: the live generation widget, the cache inspector and the job table."""
