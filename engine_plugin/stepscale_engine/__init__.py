"""Stepscale engine side: the FPM wire format, the publisher and the vLLM plugin.

Importing this package never imports vLLM; only ``stepscale_engine.plugin`` does,
and only when the hook is installed.
"""

__version__ = "0.1.0"
