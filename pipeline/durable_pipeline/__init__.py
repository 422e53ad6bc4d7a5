"""durable_pipeline: Spark jobs over amqtt-durable (README, "The data pipeline").

``source``: the ``amqtt-durable`` streaming (and batch) data source over the broker's stream
logs; ``audit``: the delivery audit of SDK delivery logs. Import ``pyspark`` lazily: the
package is an optional extra (``pip install 'amqtt-durable[pipeline]'``).
"""
