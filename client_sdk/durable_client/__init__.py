"""durable_client: the thin SDK for amqtt-durable brokers (see README, "The SDK")."""
