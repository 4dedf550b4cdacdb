"""One router per resource: jobs, plan, cluster, tenants (and tokens), health."""
