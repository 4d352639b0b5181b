"""kerasfeed's benchmark harness (a package so worker processes can import the workloads)."""
