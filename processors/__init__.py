"""Deciders: commands in, events + replies out, in one Kafka transaction."""
