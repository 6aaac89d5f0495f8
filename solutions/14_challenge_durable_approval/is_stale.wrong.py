# ✏️ EXERCISE is_stale: whether approving a gate now would approve something the person was not shown
# is_stale(gate, config, now): `gate` is a row of lab.gates() (`tool` is "<server>__<tool>",
# `created_at` an ISO time), `config` the lab's mcp.json as a dict, `now` an aware datetime.
# Return True when the entry of the server the gate's call runs on is not the one it had in
# config_when_made(gate) (changed, or gone), or when the gate is older than MAX_AGE; else False.
# A change to another server's entry doesn't make this gate stale.

def is_stale(gate, config, now):
    """Whether approving `gate` at `now`, under `config`, would be a stale approval."""
    # A plausible mistake: staleness as age only, a comparison of timestamps.
    return now - datetime.fromisoformat(gate["created_at"]) > MAX_AGE
