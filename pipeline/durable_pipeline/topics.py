"""MQTT topic-filter matching as a Spark join: which subscription filters match which topics.

The audit needs, for every topic that was sent on, the filters that match it. Distinct topics
and distinct filters are few next to the records, so the pairs are computed on those two small
sets and then joined back to the (large) sends. The rule is MQTT 3.1.1's (section 4.7) and the
same as the broker's (``amqtt_durable.topics.matches``): ``+`` is one whole level, ``#`` the
remaining levels including none (``a/#`` matches ``a``), and a topic starting with ``$`` never
matches a filter starting with a wildcard.

The pairs come from an equality join on the filter's literal prefix, so no topic meets a filter
that cannot match it by its first levels (see :func:`topic_filter_pairs`).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as sf

# {t}, {f}: the topic's and the filter's levels (split on '/', empty levels kept).
_MATCH = """
CASE
  WHEN startswith({topic}, '$') AND (startswith({filter}, '+') OR startswith({filter}, '#')) THEN false
  WHEN element_at({f}, -1) = '#' THEN
    size({t}) >= size({f}) - 1
    AND forall(zip_with(slice({f}, 1, size({f}) - 1), slice({t}, 1, size({f}) - 1), (a, b) -> a = '+' OR a = b), x -> x)
  ELSE
    size({t}) = size({f}) AND forall(zip_with({f}, {t}, (a, b) -> a = '+' OR a = b), x -> x)
END
"""


def filter_matches(topic: str = "topic", topic_filter: str = "filter") -> Column:
    """A boolean Column: the string column ``topic`` matches the filter column ``topic_filter``.

    Higher-order SQL functions over the split levels, so the check runs in the JVM without a
    Python worker.
    """

    topic_col, filter_col = f"`{topic}`", f"`{topic_filter}`"
    return sf.expr(
        _MATCH.format(
            topic=topic_col,
            filter=filter_col,
            t=f"split({topic_col}, '/', -1)",
            f=f"split({filter_col}, '/', -1)",
        )
    )


def topic_filter_pairs(topics: DataFrame, filters: DataFrame) -> DataFrame:
    """(topic, filter) for every match between the ``topic`` column of ``topics`` and the
    ``filter`` column of ``filters``; both are made distinct first.

    An equality join on the filter's literal prefix (its levels before the first wildcard, and
    their number) against every prefix of the topic, then the full check: ``a/b/+`` meets only
    topics under ``a/b``, an exact filter only its topic, ``#`` or ``+/...`` every topic.
    """

    topic_levels = sf.split("topic", "/", -1)
    prefixes = (
        topics.select("topic")
        .distinct()
        .select("topic", sf.explode(sf.sequence(sf.lit(0), sf.size(topic_levels))).alias("depth"))
        .withColumn("prefix", sf.array_join(sf.slice(topic_levels, sf.lit(1), sf.col("depth")), "/"))
    )
    filter_levels = sf.split("filter", "/", -1)
    first_wildcard = sf.array_position(sf.transform(filter_levels, lambda level: level.isin("+", "#")), True)
    literal = (
        filters.select("filter")
        .distinct()
        .withColumn("depth", sf.when(first_wildcard == 0, sf.size(filter_levels)).otherwise(first_wildcard - 1))
        .withColumn("prefix", sf.array_join(sf.slice(filter_levels, sf.lit(1), sf.col("depth")), "/"))
    )
    return prefixes.join(literal, ["depth", "prefix"]).where(filter_matches()).select("topic", "filter")
