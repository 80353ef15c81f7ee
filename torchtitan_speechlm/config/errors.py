"""The error every config check raises."""


class ConfigError(ValueError):
    """A bad config value, with the key and the fix in the message."""
