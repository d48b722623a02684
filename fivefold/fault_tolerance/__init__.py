"""Replica fault tolerance with torchft (docs/design.md#replica-fault-tolerance): `replicas` is
what a group's trainer sees of the others, `launch` starts the groups."""
