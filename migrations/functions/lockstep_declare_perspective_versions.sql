-- Records the versions a worker runs (`p_names[i]` version `p_versions[i]`, promoted
-- automatically when `p_automatic[i]`, doing `p_previous[i]` to the version it replaces) and
-- returns every version of those perspectives. Under each perspective's version lock (taken in
-- name order): a perspective with no serving version gets one — its plain name, registered
-- before versions were recorded, as version 1, else the lowest version declared; every other
-- new version is `building`. A known version keeps its status; its policy is updated.
CREATE OR REPLACE FUNCTION lockstep_declare_perspective_versions(
    p_names text[],
    p_versions integer[],
    p_automatic boolean[],
    p_previous text[]
) RETURNS SETOF wh_perspective_versions
LANGUAGE plpgsql AS $$
DECLARE
    v_name text;
    v_serving boolean;
    d record;
BEGIN
    FOR v_name IN SELECT DISTINCT n COLLATE "C" FROM unnest(p_names) n ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(
            lockstep_advisory_key('lockstep:perspective-versions:' || v_name));
    END LOOP;
    FOR v_name IN SELECT DISTINCT n COLLATE "C" FROM unnest(p_names) n ORDER BY 1 LOOP
        v_serving := EXISTS (SELECT 1 FROM wh_perspective_versions
                              WHERE perspective_name = v_name AND status = 'serving');
        IF NOT v_serving
           AND NOT EXISTS (SELECT 1 FROM wh_perspective_versions
                            WHERE perspective_name = v_name AND version = 1)
           AND (EXISTS (SELECT 1 FROM wh_perspectives WHERE perspective_name = v_name)
                OR EXISTS (SELECT 1 FROM wh_retired_perspectives
                            WHERE perspective_name = v_name)) THEN
            INSERT INTO wh_perspective_versions
                   (perspective_name, version, stored_name, status, automatic, previous)
            SELECT v_name, 1, v_name, 'serving',
                   coalesce((SELECT u.a FROM unnest(p_names, p_versions, p_automatic)
                                          AS u(n, v, a) WHERE u.n = v_name AND u.v = 1
                              LIMIT 1), true),
                   coalesce((SELECT u.p FROM unnest(p_names, p_versions, p_previous)
                                          AS u(n, v, p) WHERE u.n = v_name AND u.v = 1
                              LIMIT 1), 'retire');
            v_serving := true;
        END IF;
        FOR d IN SELECT u.v, u.a, u.p
                   FROM unnest(p_names, p_versions, p_automatic, p_previous) AS u(n, v, a, p)
                  WHERE u.n = v_name
                  ORDER BY u.v LOOP
            INSERT INTO wh_perspective_versions AS w
                   (perspective_name, version, stored_name, status, automatic, previous)
            VALUES (v_name, d.v,
                    CASE WHEN d.v = 1 THEN v_name ELSE v_name || '@v' || d.v END,
                    CASE WHEN v_serving THEN 'building' ELSE 'serving' END,
                    d.a, d.p)
            ON CONFLICT (perspective_name, version) DO UPDATE
               SET automatic = EXCLUDED.automatic, previous = EXCLUDED.previous
             WHERE (w.automatic, w.previous) IS DISTINCT FROM (EXCLUDED.automatic, EXCLUDED.previous);
            v_serving := true;
        END LOOP;
    END LOOP;
    RETURN QUERY
        SELECT * FROM wh_perspective_versions
         WHERE perspective_name = ANY (p_names)
         ORDER BY perspective_name COLLATE "C", version;
END;
$$;
