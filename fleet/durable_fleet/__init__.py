"""The fleet fault-injection harness (``amqtt-durable fleet``): devices behind a fault proxy, a
fault schedule, delivery logs and the Spark delivery audit that judges the run."""
