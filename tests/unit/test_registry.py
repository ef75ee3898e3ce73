def test_the_limits_two_stage_tables_disagree_on_are_named() -> None:
    from animastor_tasks.domain.registry import limits_differ, limits_of, registry_from_table

    base = {"audio": {"queue": "gpu.audio", "lane_limit": 3}, "image": {"queue": "gpu.image"}}
    mine = limits_of(registry_from_table(base))
    assert limits_differ(mine, mine) == []
    older = limits_of(registry_from_table({**base, "audio": {"queue": "gpu.audio", "lane_limit": 2, "book_cap": 1}}))
    assert limits_differ(mine, older) == ["audio lane_limit: 3/2", "audio book_cap: None/1"]
    assert limits_differ(mine, {"audio": mine["audio"]}) == ["image: set/-"]
