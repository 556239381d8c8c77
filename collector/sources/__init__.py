"""Sources: plugins that turn one corner of the machine into `Sample`s."""

from .infiniband import InfinibandSource
from .netdev import NetdevSource

__all__ = ["InfinibandSource", "NetdevSource"]
