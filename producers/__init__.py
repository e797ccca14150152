"""The client side: sending commands, awaiting replies, appending to delivery logs."""
