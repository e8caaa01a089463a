"""The exactly-once MQTT transport: codec, session rules, durable store, client, uplink."""
