"""The teaching harness: a lab directory, children to kill, read-only views."""
