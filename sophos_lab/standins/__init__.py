"""The world the lab plays, each in its own process: the scripted model, the recording proxy, web pages, the ledger."""
