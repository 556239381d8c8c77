"""ridethrough: keep GPU jobs running through fabric faults.

The import namespace maps the design card's top-level folders to subpackages
(``ridethrough.collector`` lives in ``collector/``, and so on).
"""

__version__ = "0.1.0"
