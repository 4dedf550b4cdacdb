"""The Ray side of zeroservice: placement, bootstrap, supervised jobs and rank metrics."""
