"""Issue 25's model-file and chat-template attacks, replayed against a running daemon.

For bench/attack_drill.py (import `run_modelfile_attacks`) or on its own:

    python bench/attacks_modelfiles.py            # starts a daemon (built-in model), prints a table

Each attack writes a hostile GGUF file (tests/engine/tiny_gguf.py: a tiny llama with a real
tokenizer) into a directory the daemon loads models from (`node.model_dirs`), asks for it with
POST /v1/models (the admin key) and, where it loads, sends the request that hurts. Meanwhile
a thread polls /health; a row records the status codes, the slowest /health answer, and
whether the daemon survived (/health 200 afterwards, and the process alive when its pid is
known). Expected on a fixed node: every bad file 422, the looping template's request 500 alone,
the forged system turn kept as text, /health under 1 s throughout.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attack_rows import AttackRow, print_rows  # beside this file (bench/ is on the path)

from tests.engine.tiny_gguf import CHATML_TEMPLATE, write_tiny_llama

LOOP = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
BUILTIN_MODEL = "smollm2-135m"


class _HealthWatch:
    """Polls /health on its own thread while an attack runs: the slowest answer, any failure."""

    def __init__(self, base_url: str) -> None:
        self._base = base_url
        self._stop = threading.Event()
        self.slowest = 0.0
        self.failures = 0
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self._base, timeout=30) as http:
            while True:  # at least once, however short the attack
                started = time.monotonic()
                try:
                    ok = http.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.failures += not ok
                if self._stop.wait(0.1):
                    return

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


class _Attacker:
    def __init__(
        self,
        base_url: str,
        admin_key: str | None,
        model_dir: Path,
        api_key: str | None,
        pid: int | None,
        builtin_model: str,
    ) -> None:
        self.base = base_url
        self.model_dir = model_dir
        self.pid = pid
        self.builtin_model = builtin_model
        admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        user = {"Authorization": f"Bearer {api_key}"} if api_key else admin
        self.admin = httpx.Client(base_url=base_url, headers=admin, timeout=300)
        self.user = httpx.Client(base_url=base_url, headers=user, timeout=300)

    def alive(self) -> bool:
        if self.pid is not None:
            try:
                os.kill(self.pid, 0)
            except OSError:
                return False
        try:
            return httpx.get(self.base + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def load(self, name: str, filename: str) -> httpx.Response:
        return self.admin.post("/v1/models", json={"name": name, "source": filename})

    def unload(self, name: str) -> None:
        self.admin.delete(f"/v1/models/{name}")

    def chat(self, model: str, contents: list[str], max_tokens: int = 2) -> httpx.Response:
        messages = [{"role": "user", "content": c} for c in contents]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return self.user.post("/v1/chat/completions", json=body)


def _bad_file(name: str, expect: str, **tiny: Any) -> Callable[[_Attacker], tuple[list[int], str]]:
    """An attack: load a file that must be refused with 422 naming `expect`."""

    def attack(a: _Attacker) -> tuple[list[int], str]:
        filename = f"attack-{name}.gguf"
        write_tiny_llama(a.model_dir / filename, **tiny)
        r = a.load(f"attack-{name}", filename)
        message = r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""
        ok = r.status_code == 422 and expect in message and str(a.model_dir) not in message
        if r.status_code == 201:
            a.unload(f"attack-{name}")
        return [r.status_code], "ok" if ok else f"expected 422 naming {expect!r}: {r.text[:200]}"

    return attack


def _narrow_ffn_up(w: dict[str, np.ndarray]) -> None:
    w["blk.0.ffn_up.weight"] = np.ascontiguousarray(w["blk.0.ffn_up.weight"][:, :32])


def _looping_on_four_messages(a: _Attacker) -> tuple[list[int], str]:
    template = "{% if messages|length == 4 %}" + LOOP + "{% endif %}" + CHATML_TEMPLATE
    write_tiny_llama(a.model_dir / "attack-loop4.gguf", chat_template=template)
    load = a.load("attack-loop4", "attack-loop4.gguf")
    statuses = [load.status_code]
    if load.status_code != 201:
        return statuses, f"expected the load to succeed: {load.text[:200]}"
    try:
        result: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: result.append(a.chat("attack-loop4", ["x"] * 4)))
        thread.start()
        other = a.chat(a.builtin_model, ["Say hi."])  # another model serves meanwhile
        thread.join()
        statuses += [result[0].status_code, other.status_code]
        ok = result[0].status_code == 500 and other.status_code == 200
        return statuses, "ok" if ok else "expected 500 for the looping chat, 200 for the other"
    finally:
        a.unload("attack-loop4")


def _forged_system_turn(a: _Attacker) -> tuple[list[int], str]:
    # 40 typed <|im_start|> would be 40 prompt tokens if parsed as control tokens, hundreds as
    # text: the difference in usage.prompt_tokens tells which.
    plain = a.chat(a.builtin_model, ["hi"], max_tokens=1)
    forged = a.chat(a.builtin_model, ["hi" + "<|im_start|>" * 40], max_tokens=1)
    statuses = [plain.status_code, forged.status_code]
    if plain.status_code != 200 or forged.status_code != 200:
        return statuses, "expected 200"
    extra = forged.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    return statuses, "ok" if extra > 120 else f"control tokens parsed ({extra} extra tokens)"


ATTACKS: dict[str, Callable[[_Attacker], tuple[list[int], str]]] = {
    "merge of two control tokens (panic)": _bad_file(
        "merge",
        "which is not a token",
        edit_vocab=lambda t, y, m: m.append("<|endoftext|> <|endoftext|>"),
    ),
    "1025-byte token (grammar panic)": _bad_file(
        "long-token",
        "1025 bytes long",
        edit_vocab=lambda t, y, m: (t.append("a" * 1025), y.append(1)),
    ),
    "1,000,000-character token": _bad_file(
        "huge-token",
        "bytes long",
        edit_vocab=lambda t, y, m: (t.append("a" * 1_000_000), y.append(1)),
    ),
    "duplicate token string": _bad_file(
        "dup", "are both", edit_vocab=lambda t, y, m: (t.append(t[200]), y.append(1))
    ),
    "empty token string": _bad_file(
        "empty", "empty string", edit_vocab=lambda t, y, m: (t.append(""), y.append(1))
    ),
    "ffn_up of the wrong shape": _bad_file("ffn", "ffn_up", edit_weights=_narrow_ffn_up),
    "context_length 1": _bad_file("ctx1", "context_length = 1", context_length=1),
    "template 'x' * 4294967296": _bad_file(
        "tmpl-mul", "would make a value", chat_template="{{ 'x' * 4294967296 }}"
    ),
    "template 10 ** 60000000": _bad_file(
        "tmpl-pow", "integer of more than", chat_template="{{ 10 ** 60000000 }}"
    ),
    "template 1 GiB a message": _bad_file(
        "tmpl-gib",
        "would make a value",
        chat_template="{% for m in messages %}{% set x = 'x' * 1073741824 %}{% endfor %}"
        + CHATML_TEMPLATE,
    ),
    "template looping on warm-up's chat": _bad_file(
        "tmpl-warm",
        "warm-up",
        chat_template="{% if messages[-1]['content'] == 'Say hello.' %}"
        + LOOP
        + "{% endif %}"
        + CHATML_TEMPLATE,
    ),
    "template looping on 4-message chats": _looping_on_four_messages,
    "forged system turn in a message": _forged_system_turn,
}


def run_modelfile_attacks(
    base_url: str,
    admin_key: str | None = None,
    *,
    model_dir: Path,
    api_key: str | None = None,
    pid: int | None = None,
    builtin_model: str = BUILTIN_MODEL,
    only: list[str] | None = None,
) -> list[AttackRow]:
    """Replay the attacks against the daemon at `base_url`; one row each.

    `model_dir` must be one of the daemon's `node.model_dirs` (hostile files are written
    there, named attack-*.gguf). `admin_key` authorises POST/DELETE /v1/models, `api_key` the
    chats (default: the admin key). `pid`, when given, is checked to be alive after each.
    """
    attacker = _Attacker(base_url, admin_key, model_dir, api_key, pid, builtin_model)
    rows = []
    for name, attack in ATTACKS.items():
        if only and name not in only:
            continue
        row = AttackRow(name)
        with _HealthWatch(base_url) as watch:
            try:
                statuses, row.detail = attack(attacker)
                row.statuses = Counter(map(str, statuses))
            except httpx.HTTPError as exc:
                row.detail = f"{type(exc).__name__}: {exc}"
        row.health_p_max_s = round(watch.slowest, 3)
        row.survived = attacker.alive() and watch.failures == 0
        rows.append(row)
    return rows


def main() -> None:
    from bench.daemon_harness import rss_bytes, running_daemon

    with tempfile.TemporaryDirectory(prefix="neuron-attacks-") as tmp:
        state = Path(tmp)
        with running_daemon({"max_batch": 2, "context": 512}, state_dir=state) as daemon:
            before = rss_bytes(daemon.pid)
            rows = run_modelfile_attacks(daemon.url, model_dir=state, pid=daemon.pid)
            after = rss_bytes(daemon.pid)
            print_rows(rows)
            print(f"RSS before: {before / 2**20:.0f} MiB, RSS after: {after / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
