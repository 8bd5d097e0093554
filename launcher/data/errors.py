"""What is wrong with a data file datasets could not read, said in one sentence."""
from __future__ import annotations

import json


def unreadable(files: list[str], key: str, builder: str, exc: Exception) -> str:
    """One sentence for data files datasets could not read: the file, the line and what is
    wrong, found by reading JSON Lines line by line (only once datasets has failed, so a good
    file is read once, by datasets)."""
    if builder == "json":
        for f in files:
            with open(f, encoding="utf-8", errors="strict") as fh:
                first = fh.read(1)
                fh.seek(0)
                if first == "[":  # one JSON document, not lines
                    try:
                        json.load(fh)
                    except ValueError as err:
                        return (f"{key}: {f} is not valid JSON ({err}). Fix that place in the "
                                "file, or write one JSON object per line (.jsonl)")
                    continue
                try:
                    for n, line in enumerate(fh, 1):
                        if not line.strip():
                            continue
                        try:
                            row = json.loads(line.rstrip("\r\n"))
                        except json.JSONDecodeError as err:
                            return (f"{key}: {f} line {n} is not valid JSON ({err.msg} at "
                                    f"column {err.colno}): {line.strip()[:80]!r}. Fix or "
                                    "remove that line")
                        if not isinstance(row, dict):
                            return (f"{key}: {f} line {n} is a JSON {type(row).__name__}, not "
                                    "an object with named fields. Each line must be one object, "
                                    'e.g. {"text": "..."}')
                except UnicodeDecodeError as err:
                    return (f"{key}: {f} is not UTF-8 text ({err}). Convert it to UTF-8")
    cause = exc.__cause__ or exc.__context__ or exc
    return (f"{key}: {', '.join(files)} could not be read as {builder} "
            f"({type(cause).__name__}: {cause})")
