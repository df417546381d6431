"""One P/D request by hand, the protocol the proxy automates: prefill with do_remote_decode, then the decode with the
prefill's kv_transfer_params; shows where the decode's prompt tokens came from (its /metrics).

Usage: python scripts/pd_request.py PREFILL_URL DECODE_URL [MODEL] [PROMPT]

Servers started with an API key (auth.api_key_env) want it on every call: export OPENAI_API_KEY with the key first,
as for any OpenAI client (the script sends it as a Bearer token).
"""

import json
import os
import sys
import urllib.request

from pdctl import auth
from pdctl.gates.parity import decode_counters

KEY = auth.headers(os.environ.get("OPENAI_API_KEY"))


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **KEY})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main() -> None:
    prefill, decode = sys.argv[1], sys.argv[2]
    model = sys.argv[3] if len(sys.argv) > 3 else "tiny"
    prompt = sys.argv[4] if len(sys.argv) > 4 else (
        "Question: Natalie sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalie sell altogether in April and May?\nAnswer:")
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    before = decode_counters([decode], headers=KEY)
    pre = post(prefill, {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}})
    kvp = pre["kv_transfer_params"]
    print(f"1. prefill {prefill}: {pre['usage']['prompt_tokens']} prompt tokens; kv_transfer_params:")
    print("   " + json.dumps(kvp))
    out = post(decode, {**body, "kv_transfer_params": kvp})
    after = decode_counters([decode], headers=KEY)
    print(f"2. decode {decode}: {out['choices'][0]['text']!r}")
    print(f"3. decode's prompt tokens: {after['external'] - before['external']:.0f} by KV transfer, "
          f"{after['local'] - before['local']:.0f} computed locally; NIXL bytes "
          f"{after['bytes'] - before['bytes']:.0f}")


if __name__ == "__main__":
    main()
