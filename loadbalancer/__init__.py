"""loadbalancer: per-stage balancers (membership, health, routing policies, balance metrics).
Filled by the disaggregated-serving issue."""
