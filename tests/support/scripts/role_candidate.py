"""A candidate for the coordinator's role in its own process (tests/library/ha/test_leadership.py): it
campaigns, says when it holds the role (with its token), then writes `by/<name>` through the
fence every 0.2 s and says each outcome, until it is fenced or killed.

    python role_candidate.py ENDPOINTS NAME TTL
"""
import sys
import time

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from checkpointless.ha.etcd import Etcd, EtcdError, EtcdUnavailable  # noqa: E402
from checkpointless.ha.leadership import Fenced, Role  # noqa: E402

endpoints, name, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3])
role = Role(Etcd(endpoints, timeout_s=1.0), "job/coordinator", {"name": name}, ttl_s=ttl,
            on_lost=lambda why: print(f"lost {why}", flush=True))
role.campaign()
print(f"holds {role.token}", flush=True)
i = 0
while True:
    i += 1
    try:
        role.write(f"by/{name}", str(i))
        print(f"wrote {i}", flush=True)
    except Fenced as exc:
        print(f"fenced {exc}", flush=True)
        sys.exit(3)
    except (EtcdUnavailable, EtcdError) as exc:
        print(f"unavailable {exc}", flush=True)
    time.sleep(0.2)
