"""coordinator=etcd: the coordinator's role held under an etcd lease, the job's facts kept in etcd
for whoever takes the role next, the node agents' watch on who holds it, and the door to the
holder's store. An add-on above the control plane: it imports control/ and protocol/, and nothing
below it imports it.
"""
from . import member
from .etcd import Etcd, EtcdError, EtcdUnavailable, parse_endpoints
from .etcd_facts import JobFacts
from .leadership import Fenced, Role
from .member import MemberSpec
from .role_watch import RoleWatch
from .store_door import StoreDoor

__all__ = ["member", "Etcd", "EtcdError", "EtcdUnavailable", "parse_endpoints", "JobFacts", "Fenced",
           "Role", "MemberSpec", "RoleWatch", "StoreDoor"]
