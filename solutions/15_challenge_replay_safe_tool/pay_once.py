# ✏️ EXERCISE pay_once: pay `amount` to `to` at most once per key, the key stored with its payment
# pay_once(db_path, key, to, amount) is the effect of the bank's make_payment tool. Make it:
# - on a key's first call: insert the payment into `payments` and the key into `idempotency_keys`
#   (with to, amount and the receipt), and return the receipt f"payment {id}: {amount} to {to}";
# - on a repeat of the key with the same to and amount: pay nothing, return the first receipt;
# - on the key with another to or amount: pay nothing, raise ValueError;
# - so that, whenever the process dies, the bank never holds a payment without its key.
# The bank server runs this whole cell as a module: import here what you use.

import sqlite3
from contextlib import closing


def pay_once(db_path, key, to, amount):
    """Pay `amount` coins to account `to`, once per idempotency `key`; the receipt."""
    # One transaction (`with conn`): the payment and its key are committed together, or neither is.
    with closing(sqlite3.connect(db_path, timeout=10)) as conn, conn:
        seen = conn.execute(
            "SELECT to_account, amount, result FROM idempotency_keys WHERE key = ?", (key,)
        ).fetchone()
        if seen is not None:
            if (seen[0], seen[1]) != (to, amount):
                raise ValueError(f"idempotency key {key!r} was used for another payment: {seen[2]}")
            return seen[2]  # a repeat: the first call's receipt, and no second payment
        payment = conn.execute(
            "INSERT INTO payments (to_account, amount) VALUES (?, ?)", (to, amount)
        ).lastrowid
        receipt = f"payment {payment}: {amount} to {to}"
        # The key is the table's PRIMARY KEY: of two first calls at once, the second one's insert
        # fails, and its payment is rolled back with it.
        conn.execute(
            "INSERT INTO idempotency_keys (key, to_account, amount, result) VALUES (?, ?, ?, ?)",
            (key, to, amount, receipt),
        )
        return receipt
