"""Processes and process groups: the launcher (`launch`), the mesh of groups (`mesh`, from the pure
`topology`), every collective (`comm`) and the workers' liveness (`watchdog`)
(docs/design.md#the-mesh)."""
