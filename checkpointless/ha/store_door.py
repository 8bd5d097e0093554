"""A node's door to the coordinator's store, for coordinator=etcd: the same door every node uses
(control/node_door.py), whose far end `role_watch.py` moves to each new holder of the role. With
hold=True (the default) calls not yet answered wait for the next coordinator instead of failing."""
from ..control.node_door import StoreDoor

__all__ = ["StoreDoor"]
