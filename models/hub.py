"""The Hugging Face hub as the launcher sees it before any worker starts: is it reachable, is a
name a hub id or a local folder, and one sentence for why an id could not be resolved.

Shared by the pre-flight (launcher/run/preflight.py) and the memory plan (launcher/plan/), which both
resolve the recipe's model before launch; neither imports the other for these.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path


def looks_like_path(ident: str) -> bool:
    """A local folder, or meant as one: it exists on disk, or starts with '/', '.' or '~' (a hub
    id is 'org/name', which a relative path with one slash also is: that one counts as a path
    only when it exists)."""
    return ident.startswith(("/", ".", "~")) or Path(ident).expanduser().exists()


def offline_unless_reachable(cfg) -> None:
    """When the recipe names hub ids and the hub cannot be reached, go offline at once (for this
    process and the workers it starts), so each check reads the local cache instead of retrying
    the network for minutes. huggingface_hub reads HF_HUB_OFFLINE when it is imported, so this
    must run before anything imports it (this module does not)."""
    ids = [cfg.model.id, cfg.tokenizer.id if cfg.tokenizer.kind == "hub" else None,
           cfg.data.id if cfg.data.source == "hub" else None]
    remote = [i for i in ids if i and not looks_like_path(i)]
    if not remote or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false"):
        return
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        print("[launcher] the Hugging Face hub cannot be reached: working offline from the "
              "local cache", flush=True)


def hub_problem(exc: Exception, what: str, key: str, ident: str) -> str:
    """One sentence for why `ident` could not be resolved, told apart by the exception's type
    (transformers and datasets wrap the hub's errors, so the whole chain is searched)."""
    from huggingface_hub import errors
    gated = getattr(errors, "GatedRepoError", ())
    missing = getattr(errors, "RepositoryNotFoundError", ())
    offline = tuple(t for t in (getattr(errors, "LocalEntryNotFoundError", None),
                                getattr(errors, "OfflineModeIsEnabled", None)) if t)
    kind = "--repo-type dataset " if what == "dataset" else ""
    chain, cur = [], exc
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    if gated and any(isinstance(e, gated) for e in chain):
        return (f"{key}={ident}: the {what} is gated on the Hugging Face hub. Accept its license "
                f"on https://huggingface.co/{ident} and log in (`huggingface-cli login`, or "
                "HF_TOKEN)")
    if missing and any(isinstance(e, missing) for e in chain):
        return (f"{key}={ident}: no such {what} on the Hugging Face hub (or it is private). "
                "Check the id, or point it at a local folder")
    if (offline and any(isinstance(e, offline) for e in chain)) or any(
            isinstance(e, (ConnectionError, TimeoutError)) for e in chain):
        return (f"{key}={ident}: the {what} is not in the local cache and the Hugging Face hub "
                "cannot be reached (no network, or HF_HUB_OFFLINE=1). Download it where there is "
                f"a network (`huggingface-cli download {kind}{ident}`) and copy the cache here, "
                f"or point {key} at a local folder")
    return f"{key}={ident}: the {what} could not be loaded: {type(exc).__name__}: {exc}"
