#!/bin/bash
# measure2.sh DB NAME "DDL(%s=table)" CONSUMER-EXPR : per-row server instructions, WAL and heap bytes of INSERT ... ON CONFLICT DO NOTHING
N1=2000; N2=12000
db=$1; name=$2; ddl=$3; cons=$4
P="psql -h 127.0.0.1 -p 55433 -U postgres -d $db -Atq"
R=/tmp/hrow/pg
gen() { echo "INSERT INTO t_$name (consumer, event_id, event_at)
 SELECT $cons, u, to_timestamp((1780000000000+i)/1000.0)
 FROM (SELECT i, (lpad(to_hex(1780000000000+i),12,'0') || '7' || substr(md5(i::text),1,3) || '8' || substr(md5(i::text),4,15))::uuid AS u
       FROM generate_series($2+1, $2+$1) i) s ON CONFLICT DO NOTHING"; }
tot() {
 $P -c "DROP TABLE IF EXISTS t_$name" -c "${ddl//%s/t_$name}" >/dev/null 2>&1
 $P -c "$(gen 1000 0)" >/dev/null
 l0=$($P -c "select pg_current_wal_insert_lsn()")
 pid=$($P -c "select pg_backend_pid()" -c "$(gen $1 100000)" | head -1)
 l1=$($P -c "select pg_current_wal_insert_lsn()")
 for i in $(seq 1 100); do grep -q '^summary' $R/cg/cg.$pid 2>/dev/null && break; sleep 0.3; done
 echo "$(awk '/^summary/{print $2}' $R/cg/cg.$pid) $($P -c "select pg_wal_lsn_diff('$l1','$l0')")"
}
read a wa <<<"$(tot $N1)"; read b wb <<<"$(tot $N2)"
sz=$($P -c "select round(avg(pg_column_size(t.*))) || ' row, pk ' || pg_relation_size('t_${name}_pkey')/(select count(*) from t_$name) || ' B/row' from t_$name t")
echo "$db $name instr/row=$(( (b-a)/(N2-N1) )) wal/row=$(( (wb-wa)/(N2-N1) )) $sz"
