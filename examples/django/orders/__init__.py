"""The shop's orders: a checkout, the order its durable task writes, and the payment."""
