//! The Nexmark generator as a source (`kind = "nexmark"`): the event stream of the benchmark
//! every stream processor publishes (an online auction: people, auctions, bids).
//!
//! It follows the standard generator (Beam's and Flink's): event `n` is a person, an auction or
//! a bid by `n % 50` (1 : 3 : 46); ids grow with `n` (`lastBase0PersonId`,
//! `lastBase0AuctionId`); a bid picks a hot auction half of the time and a hot bidder three
//! quarters of the time, else a random recent one; prices are log-uniform from 1 to 10⁶ (in
//! cents, ×100); event time is `base_time + n × inter_event_delay`, shuffled within groups of
//! `out_of_order_group` events for bounded out-of-orderness; `extra` pads rows to the standard
//! average sizes.
//!
//! **Every event is a pure function of `(seed, n)`**: its random draws come from a generator
//! seeded by both, so any offset range can be regenerated exactly — the replay the engine's
//! exactly-once rests on. Partition `p` of `P` holds the events with `n % P == p`, its offset `o`
//! is event `o × P + p`, so partitions advance through event time together. One source serves
//! one table (`table = "bid"`, `"auction"` or `"person"`): it walks every event of its range and
//! keeps those of its kind, so offsets are event positions and the three tables of one seed
//! describe the same auction.
//!
//! With `events_per_second = 0` every event is available at once (a benchmark run); otherwise
//! events become available at that rate from when the source opens. Event time is spaced at
//! `events_per_second` (10 000/s when unthrottled), independent of when rows are generated.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{
    ArrayRef, Int64Builder, RecordBatch, StringBuilder, TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use serde::Deserialize;
use sluice_engine::source::with_lineage_fields;
use sluice_engine::{
    AvailableRange, OffsetRange, PartitionId, Source, SourceContext, SourceRead, cpu_bound,
};

use crate::error::{ConnectorError, Result};

/// Which of the three Nexmark tables a source produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NexmarkTable {
    /// `person`: id, name, email_address, credit_card, city, state, date_time, extra.
    Person,
    /// `auction`: id, item_name, description, initial_bid, reserve, date_time, expires, seller,
    /// category, extra.
    Auction,
    /// `bid`: auction, bidder, price, channel, url, date_time, extra.
    Bid,
}

/// The `[sources.<name>]` settings of `kind = "nexmark"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NexmarkSourceConfig {
    /// The table this source produces.
    pub table: NexmarkTable,
    /// Generation rate; 0 (default) makes every event available at once.
    #[serde(default)]
    pub events_per_second: u64,
    /// Events in the stream (all kinds), default 10 000 000.
    #[serde(default = "default_total_events")]
    pub total_events: u64,
    /// Partitions, default 4.
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// Seed of every random draw, default 1.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Event time of event 0 (RFC 3339), default `2024-01-01T00:00:00Z`.
    #[serde(default)]
    pub base_time: Option<String>,
    /// Events are shuffled in event time within groups of this many (1 = in order).
    #[serde(default = "default_group")]
    pub out_of_order_group: u64,
    /// The most events (of all kinds) one batch reads across partitions, default 1 000 000.
    #[serde(default = "default_max_records")]
    pub max_records_per_batch: u64,
}

fn default_total_events() -> u64 {
    10_000_000
}
fn default_partitions() -> u32 {
    4
}
fn default_seed() -> u64 {
    1
}
fn default_group() -> u64 {
    1
}
fn default_max_records() -> u64 {
    1_000_000
}

impl NexmarkSourceConfig {
    /// Settings for `table` with every default.
    pub fn new(table: NexmarkTable) -> Self {
        NexmarkSourceConfig {
            table,
            events_per_second: 0,
            total_events: default_total_events(),
            partitions: default_partitions(),
            seed: default_seed(),
            base_time: None,
            out_of_order_group: default_group(),
            max_records_per_batch: default_max_records(),
        }
    }
}

// The standard generator's constants.
const PERSON_PROPORTION: u64 = 1;
const AUCTION_PROPORTION: u64 = 3;
const TOTAL_PROPORTION: u64 = 50;
const FIRST_PERSON_ID: i64 = 1000;
const FIRST_AUCTION_ID: i64 = 1000;
const FIRST_CATEGORY_ID: i64 = 10;
const NUM_CATEGORIES: u64 = 5;
const NUM_ACTIVE_PEOPLE: u64 = 1000;
const NUM_IN_FLIGHT_AUCTIONS: u64 = 100;
const PERSON_ID_LEAD: u64 = 10;
const AUCTION_ID_LEAD: u64 = 10;
const HOT_AUCTION_RATIO: u64 = 2;
const HOT_SELLER_RATIO: u64 = 4;
const HOT_BIDDER_RATIO: u64 = 4;
const HOT_CHANNELS_RATIO: u64 = 2;
const CHANNELS_NUMBER: u64 = 10_000;
const AVG_PERSON_BYTES: usize = 200;
const AVG_AUCTION_BYTES: usize = 500;
const AVG_BID_BYTES: usize = 100;
const DEFAULT_RATE: u64 = 10_000;
const FIRST_NAMES: [&str; 11] = [
    "Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter", "Walter",
];
const LAST_NAMES: [&str; 9] = [
    "Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones", "Noris",
];
const US_STATES: [&str; 6] = ["AZ", "CA", "ID", "OR", "WA", "WY"];
const US_CITIES: [&str; 10] = [
    "Phoenix",
    "Los Angeles",
    "San Francisco",
    "Boise",
    "Portland",
    "Bend",
    "Redmond",
    "Seattle",
    "Kent",
    "Cheyenne",
];
const HOT_CHANNELS: [&str; 4] = ["Google", "Facebook", "Baidu", "Apple"];
const HOT_URLS: [&str; 4] = [
    "https://www.nexmark.com/googl/item.htm?query=1",
    "https://www.nexmark.com/faceb/item.htm?query=1",
    "https://www.nexmark.com/baidu/item.htm?query=1",
    "https://www.nexmark.com/apple/item.htm?query=1",
];
/// Padding text: `extra` columns are slices of it (random start and length), which keeps rows
/// at the standard sizes without drawing a random number per character.
const PAD: &str = "qwertyuiopasdfghjklzxcvbnmQWERTYUIOPASDFGHJKLZXCVBNM0123456789\
qazwsxedcrfvtgbyhnujmikolpPLOKIJUHYGTFRDESWAQmnbvcxzlkjhgfdsapoiuytrewq9876543210\
zaqxswcdevfrbgtnhymjukilopZAQXSWCDEVFRBGTNHYMJUKILOPpoiulkjhmnbvgfdsrewqazxcvbnm\
plmoknijbuhvygctfxrdzeswaqQAWSEDRFTGYHUJIKOLPMNBVCXZasdfqwerzxcvtyuighjkbnmlopiu\
mnbvcxzasdfghjklpoiuytrewqQWERTYUIOPLKJHGFDSAZXCVBNM1357924680asdfghjklqwertyuiop";

/// A splitmix64 stream: small, fast, and seeded per event.
struct EventRng(u64);

impl EventRng {
    /// The random stream of event `n` under `seed`.
    fn new(seed: u64, n: u64) -> Self {
        EventRng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n.wrapping_mul(0xBF58_476D_1CE4_E5B9))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A slice of [`PAD`] of about `len` bytes (±10 %).
    fn pad(&mut self, len: usize) -> &'static str {
        let (shortest, spread) = pad_range(len);
        let len = (shortest + self.below((spread + 1) as u64) as usize).min(PAD.len());
        let start = self.below((PAD.len() - len + 1) as u64) as usize;
        &PAD[start..start + len]
    }
}

/// What kind event `n` is.
fn kind_of(n: u64) -> NexmarkTable {
    match n % TOTAL_PROPORTION {
        r if r < PERSON_PROPORTION => NexmarkTable::Person,
        r if r < PERSON_PROPORTION + AUCTION_PROPORTION => NexmarkTable::Auction,
        _ => NexmarkTable::Bid,
    }
}

/// The id (base 0) of the last person generated at or before event `n`.
fn last_base0_person_id(n: u64) -> u64 {
    let epoch = n / TOTAL_PROPORTION;
    let mut offset = n % TOTAL_PROPORTION;
    if offset >= PERSON_PROPORTION {
        // Past this epoch's people: the last one of them.
        offset = PERSON_PROPORTION - 1;
    }
    epoch * PERSON_PROPORTION + offset
}

/// The id (base 0) of the last auction generated at or before event `n`.
fn last_base0_auction_id(n: u64) -> u64 {
    let mut epoch = n / TOTAL_PROPORTION;
    let mut offset = n % TOTAL_PROPORTION;
    if offset < PERSON_PROPORTION {
        // Before this epoch's auctions: the last one of the previous epoch.
        if epoch == 0 {
            return 0;
        }
        epoch -= 1;
        offset = AUCTION_PROPORTION - 1;
    } else if offset >= PERSON_PROPORTION + AUCTION_PROPORTION {
        offset = AUCTION_PROPORTION - 1;
    } else {
        offset -= PERSON_PROPORTION;
    }
    epoch * AUCTION_PROPORTION + offset
}

/// A random recent person (base 0), with a few not yet generated ("leads").
fn next_base0_person_id(n: u64, rng: &mut EventRng) -> u64 {
    let people = last_base0_person_id(n) + 1;
    let active = people.min(NUM_ACTIVE_PEOPLE);
    people - active + rng.below(active + PERSON_ID_LEAD)
}

/// A random auction likely still in flight (base 0), with a few leads.
fn next_base0_auction_id(n: u64, rng: &mut EventRng) -> u64 {
    let last = last_base0_auction_id(n);
    let min = last.saturating_sub(NUM_IN_FLIGHT_AUCTIONS);
    min + rng.below(last - min + 1 + AUCTION_ID_LEAD)
}

/// Log-uniform from 100 to 10⁸ (cents).
fn next_price(rng: &mut EventRng) -> i64 {
    (10f64.powf(rng.unit() * 6.0) * 100.0).round() as i64
}

/// The generator: event numbers to rows.
#[derive(Debug, Clone)]
struct Generator {
    seed: u64,
    base_time: i64,
    /// Event-time distance between consecutive events, µs (fractional: 10 000/s is 100 µs).
    inter_event_micros: f64,
    group: u64,
}

impl Generator {
    /// Event time of event `n`: its place after shuffling within its out-of-order group.
    fn event_time(&self, n: u64) -> i64 {
        let adjusted = if self.group <= 1 {
            n
        } else {
            n / self.group * self.group + (n * 953) % self.group
        };
        self.base_time + (adjusted as f64 * self.inter_event_micros) as i64
    }
}

/// Arrow builders for one table (one value per read, so the variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum Columns {
    Person {
        id: Int64Builder,
        name: StringBuilder,
        email: StringBuilder,
        card: StringBuilder,
        city: StringBuilder,
        state: StringBuilder,
        time: TimestampMicrosecondBuilder,
        extra: StringBuilder,
    },
    Auction {
        id: Int64Builder,
        item: StringBuilder,
        description: StringBuilder,
        initial_bid: Int64Builder,
        reserve: Int64Builder,
        time: TimestampMicrosecondBuilder,
        expires: TimestampMicrosecondBuilder,
        seller: Int64Builder,
        category: Int64Builder,
        extra: StringBuilder,
    },
    Bid {
        auction: Int64Builder,
        bidder: Int64Builder,
        price: Int64Builder,
        channel: StringBuilder,
        url: StringBuilder,
        time: TimestampMicrosecondBuilder,
        extra: StringBuilder,
    },
}

fn timestamps(capacity: usize) -> TimestampMicrosecondBuilder {
    TimestampMicrosecondBuilder::with_capacity(capacity).with_timezone("UTC")
}

/// The schema of `table` (without lineage).
pub fn nexmark_schema(table: NexmarkTable) -> Schema {
    let time = || DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
    let f = |name: &str, t: DataType| Field::new(name, t, false);
    let fields = match table {
        NexmarkTable::Person => vec![
            f("id", DataType::Int64),
            f("name", DataType::Utf8),
            f("email_address", DataType::Utf8),
            f("credit_card", DataType::Utf8),
            f("city", DataType::Utf8),
            f("state", DataType::Utf8),
            f("date_time", time()),
            f("extra", DataType::Utf8),
        ],
        NexmarkTable::Auction => vec![
            f("id", DataType::Int64),
            f("item_name", DataType::Utf8),
            f("description", DataType::Utf8),
            f("initial_bid", DataType::Int64),
            f("reserve", DataType::Int64),
            f("date_time", time()),
            f("expires", time()),
            f("seller", DataType::Int64),
            f("category", DataType::Int64),
            f("extra", DataType::Utf8),
        ],
        NexmarkTable::Bid => vec![
            f("auction", DataType::Int64),
            f("bidder", DataType::Int64),
            f("price", DataType::Int64),
            f("channel", DataType::Utf8),
            f("url", DataType::Utf8),
            f("date_time", time()),
            f("extra", DataType::Utf8),
        ],
    };
    Schema::new(fields)
}

/// The most bytes [`EventRng::pad`] returns for `len`.
const fn most_pad_bytes(len: usize) -> usize {
    let (shortest, spread) = pad_range(len);
    let most = shortest + spread;
    if most < PAD.len() { most } else { PAD.len() }
}

/// The lengths [`EventRng::pad`] draws for `len` (before the cap at [`PAD`]'s length): from
/// the first number up to that plus the second, about `len` ± 10 %.
const fn pad_range(len: usize) -> (usize, usize) {
    (len * 9 / 10, len / 5)
}

/// The longest of `texts`.
const fn longest(texts: &[&str]) -> usize {
    let mut i = 0;
    let mut most = 0;
    while i < texts.len() {
        if texts[i].len() > most {
            most = texts[i].len();
        }
        i += 1;
    }
    most
}

/// Decimal digits of the largest number below `n` (`n > 1`).
const fn digits_below(n: u64) -> usize {
    (n - 1).ilog10() as usize + 1
}

impl Columns {
    /// Builders for `rows` rows of `table`, each text column sized for the longest value
    /// [`Columns::push`] can write (the bounds below follow its formats).
    ///
    /// Sized by the longest value, not the average: a builder that outgrows its capacity
    /// doubles it, and the untouched half is memory the batch holds and never uses. Most bytes
    /// are the `extra` padding, whose bound is a tenth above its average; all text together is
    /// sized about a seventh above what it holds (a short column such as `city` more).
    fn new(table: NexmarkTable, rows: usize) -> Self {
        let text = |most_bytes: usize| StringBuilder::with_capacity(rows, rows * most_bytes);
        let ints = || Int64Builder::with_capacity(rows);
        match table {
            NexmarkTable::Person => Columns::Person {
                id: ints(),
                name: text(longest(&FIRST_NAMES) + 1 + longest(&LAST_NAMES)),
                email: text(most_pad_bytes(7) + "@".len() + most_pad_bytes(5) + ".com".len()),
                card: text("0000 0000 0000 0000".len()),
                city: text(longest(&US_CITIES)),
                state: text(longest(&US_STATES)),
                time: timestamps(rows),
                extra: text(most_pad_bytes(AVG_PERSON_BYTES - 80)),
            },
            NexmarkTable::Auction => Columns::Auction {
                id: ints(),
                item: text(most_pad_bytes(20)),
                description: text(most_pad_bytes(100)),
                initial_bid: ints(),
                reserve: ints(),
                time: timestamps(rows),
                expires: timestamps(rows),
                seller: ints(),
                category: ints(),
                extra: text(most_pad_bytes(AVG_AUCTION_BYTES - 200)),
            },
            NexmarkTable::Bid => Columns::Bid {
                auction: ints(),
                bidder: ints(),
                price: ints(),
                channel: text(
                    longest(&HOT_CHANNELS).max("channel-".len() + digits_below(CHANNELS_NUMBER)),
                ),
                url: text(longest(&HOT_URLS).max(
                    "https://www.nexmark.com/".len()
                        + most_pad_bytes(5)
                        + "/".len()
                        + most_pad_bytes(5)
                        + "/item.htm?query=1&channel_id=".len()
                        + digits_below(CHANNELS_NUMBER),
                )),
                time: timestamps(rows),
                extra: text(most_pad_bytes(AVG_BID_BYTES - 60)),
            },
        }
    }

    /// Appends event `n` (of this table's kind).
    fn push(&mut self, g: &Generator, n: u64) {
        let mut rng = EventRng::new(g.seed, n);
        let time = g.event_time(n);
        match self {
            Columns::Person {
                id,
                name,
                email,
                card,
                city,
                state,
                time: t,
                extra,
            } => {
                id.append_value(last_base0_person_id(n) as i64 + FIRST_PERSON_ID);
                let first = FIRST_NAMES[rng.below(FIRST_NAMES.len() as u64) as usize];
                let last = LAST_NAMES[rng.below(LAST_NAMES.len() as u64) as usize];
                let _ = write!(name, "{first} {last}");
                name.append_value("");
                let _ = write!(email, "{}@{}.com", rng.pad(7), rng.pad(5));
                email.append_value("");
                let _ = write!(
                    card,
                    "{:04} {:04} {:04} {:04}",
                    rng.below(10_000),
                    rng.below(10_000),
                    rng.below(10_000),
                    rng.below(10_000)
                );
                card.append_value("");
                city.append_value(US_CITIES[rng.below(US_CITIES.len() as u64) as usize]);
                state.append_value(US_STATES[rng.below(US_STATES.len() as u64) as usize]);
                t.append_value(time);
                extra.append_value(rng.pad(AVG_PERSON_BYTES - 80));
            }
            Columns::Auction {
                id,
                item,
                description,
                initial_bid,
                reserve,
                time: t,
                expires,
                seller,
                category,
                extra,
            } => {
                id.append_value(last_base0_auction_id(n) as i64 + FIRST_AUCTION_ID);
                item.append_value(rng.pad(20));
                description.append_value(rng.pad(100));
                let initial = next_price(&mut rng);
                initial_bid.append_value(initial);
                reserve.append_value(initial + next_price(&mut rng));
                t.append_value(time);
                // Open for a random stretch of event time around the in-flight window.
                let length = (g.inter_event_micros
                    * (NUM_IN_FLIGHT_AUCTIONS * TOTAL_PROPORTION / AUCTION_PROPORTION) as f64
                    * (0.5 + rng.unit())) as i64;
                expires.append_value(time + length.max(1));
                let seller_id = if rng.below(HOT_SELLER_RATIO) > 0 {
                    last_base0_person_id(n) / HOT_SELLER_RATIO * HOT_SELLER_RATIO
                } else {
                    next_base0_person_id(n, &mut rng)
                };
                seller.append_value(seller_id as i64 + FIRST_PERSON_ID);
                category.append_value(FIRST_CATEGORY_ID + rng.below(NUM_CATEGORIES) as i64);
                extra.append_value(rng.pad(AVG_AUCTION_BYTES - 200));
            }
            Columns::Bid {
                auction,
                bidder,
                price,
                channel,
                url,
                time: t,
                extra,
            } => {
                let auction_id = if rng.below(HOT_AUCTION_RATIO) > 0 {
                    last_base0_auction_id(n) / HOT_AUCTION_RATIO * HOT_AUCTION_RATIO
                } else {
                    next_base0_auction_id(n, &mut rng)
                };
                auction.append_value(auction_id as i64 + FIRST_AUCTION_ID);
                let bidder_id = if rng.below(HOT_BIDDER_RATIO) > 0 {
                    // The second of each group, so hot bidders and hot sellers differ.
                    last_base0_person_id(n) / HOT_BIDDER_RATIO * HOT_BIDDER_RATIO + 1
                } else {
                    next_base0_person_id(n, &mut rng)
                };
                bidder.append_value(bidder_id as i64 + FIRST_PERSON_ID);
                price.append_value(next_price(&mut rng));
                if rng.below(HOT_CHANNELS_RATIO) > 0 {
                    let i = rng.below(HOT_CHANNELS.len() as u64) as usize;
                    channel.append_value(HOT_CHANNELS[i]);
                    url.append_value(HOT_URLS[i]);
                } else {
                    let c = rng.below(CHANNELS_NUMBER);
                    let _ = write!(channel, "channel-{c}");
                    channel.append_value("");
                    let _ = write!(
                        url,
                        "https://www.nexmark.com/{}/{}/item.htm?query=1&channel_id={c}",
                        rng.pad(5),
                        rng.pad(5)
                    );
                    url.append_value("");
                }
                t.append_value(time);
                extra.append_value(rng.pad(AVG_BID_BYTES - 60));
            }
        }
    }

    fn finish(self) -> Vec<ArrayRef> {
        fn a<T: arrow::array::ArrayBuilder>(mut b: T) -> ArrayRef {
            b.finish()
        }
        match self {
            Columns::Person {
                id,
                name,
                email,
                card,
                city,
                state,
                time,
                extra,
            } => vec![
                a(id),
                a(name),
                a(email),
                a(card),
                a(city),
                a(state),
                a(time),
                a(extra),
            ],
            Columns::Auction {
                id,
                item,
                description,
                initial_bid,
                reserve,
                time,
                expires,
                seller,
                category,
                extra,
            } => vec![
                a(id),
                a(item),
                a(description),
                a(initial_bid),
                a(reserve),
                a(time),
                a(expires),
                a(seller),
                a(category),
                a(extra),
            ],
            Columns::Bid {
                auction,
                bidder,
                price,
                channel,
                url,
                time,
                extra,
            } => vec![
                a(auction),
                a(bidder),
                a(price),
                a(channel),
                a(url),
                a(time),
                a(extra),
            ],
        }
    }
}

/// The Nexmark generator as a [`Source`]. See the module docs.
#[derive(Debug, Clone)]
pub struct NexmarkSource {
    config: NexmarkSourceConfig,
    generator: Generator,
    schema: SchemaRef,
    opened: Instant,
    /// The source's name in the job, for messages.
    name: String,
}

impl NexmarkSource {
    /// A source for `config`.
    ///
    /// # Errors
    /// If `partitions` or `out_of_order_group` is 0, or `base_time` is not RFC 3339.
    pub fn new(config: NexmarkSourceConfig) -> Result<Self> {
        if config.partitions == 0 {
            return Err(ConnectorError::Config(
                "partitions must be at least 1".into(),
            ));
        }
        if config.out_of_order_group == 0 {
            return Err(ConnectorError::Config(
                "out_of_order_group must be at least 1 (1 = in order)".into(),
            ));
        }
        let base_time = match &config.base_time {
            None => 1_704_067_200_000_000, // 2024-01-01T00:00:00Z
            Some(text) => chrono::DateTime::parse_from_rfc3339(text)
                .map_err(|e| {
                    ConnectorError::Config(format!("base_time '{text}' is not RFC 3339: {e}"))
                })?
                .timestamp_micros(),
        };
        let rate = if config.events_per_second == 0 {
            DEFAULT_RATE
        } else {
            config.events_per_second
        };
        let generator = Generator {
            seed: config.seed,
            base_time,
            inter_event_micros: 1e6 / rate as f64,
            group: config.out_of_order_group,
        };
        let schema = with_lineage_fields(&nexmark_schema(config.table), false);
        Ok(NexmarkSource {
            config,
            generator,
            schema,
            opened: Instant::now(),
            name: "nexmark".into(),
        })
    }

    /// Events of partition `p` among the first `events` of the stream.
    fn partition_len(&self, p: u64, events: u64) -> u64 {
        let parts = u64::from(self.config.partitions);
        if events <= p {
            0
        } else {
            (events - p).div_ceil(parts)
        }
    }

    /// The rows of `partition` for offsets `range`, generated.
    pub fn generate(&self, partition: u64, range: OffsetRange) -> Result<RecordBatch> {
        let parts = u64::from(self.config.partitions);
        let table = self.config.table;
        let start = u64::try_from(range.start).unwrap_or(0);
        let end = u64::try_from(range.end).unwrap_or(0);
        // Counted, not estimated from the table's share: with a partition count sharing a
        // factor with the event mix's period (4 and 50), the share differs between partitions
        // (partitions 1 and 3 hold 4 auctions in 50 events, not 3), and a builder sized below
        // its rows doubles.
        let expected = (start..end)
            .filter(|offset| kind_of(offset * parts + partition) == table)
            .count();
        let mut columns = Columns::new(table, expected);
        let mut offsets = Int64Builder::with_capacity(expected);
        for offset in start..end {
            let n = offset * parts + partition;
            if kind_of(n) == table {
                columns.push(&self.generator, n);
                offsets.append_value(offset as i64);
            }
        }
        let offsets = offsets.finish();
        let rows = offsets.len();
        let mut arrays = columns.finish();
        let partition = partition.to_string();
        arrays.push(Arc::new(arrow::array::StringArray::from_iter_values(
            std::iter::repeat_n(partition.as_str(), rows),
        )));
        arrays.push(Arc::new(offsets));
        // A column holding much more than its rows use is shrunk to them: a text column is
        // sized for its longest values (`Columns::new`), and the capacity left over — about a
        // seventh of the text, 20 MB of a batch of a million bids — would be held as long as
        // any of the batch's rows lives (a join keeps them as its state). Arrow's buffers are
        // 64-byte aligned, which Rust's `realloc` serves by a copy, so a column only rounded
        // up to that alignment is left as it is.
        for array in &mut arrays {
            let Ok(used) = array.to_data().get_slice_memory_size() else {
                continue;
            };
            if array.get_array_memory_size().saturating_sub(used) > used / 64 + 4096
                && let Some(only) = Arc::get_mut(array)
            {
                only.shrink_to_fit();
            }
        }
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), arrays)?)
    }
}

#[async_trait]
impl Source for NexmarkSource {
    async fn open(&mut self, ctx: SourceContext) -> sluice_engine::Result<SchemaRef> {
        self.opened = Instant::now();
        self.name = ctx.name;
        Ok(Arc::clone(&self.schema))
    }

    async fn available(&self) -> sluice_engine::Result<BTreeMap<PartitionId, AvailableRange>> {
        let events = if self.config.events_per_second == 0 {
            self.config.total_events
        } else {
            let elapsed = self.opened.elapsed().as_secs_f64();
            ((elapsed * self.config.events_per_second as f64) as u64).min(self.config.total_events)
        };
        Ok((0..u64::from(self.config.partitions))
            .map(|p| {
                let range = AvailableRange {
                    initial: 0,
                    latest: self.partition_len(p, events) as i64,
                };
                (p.to_string(), range)
            })
            .collect())
    }

    async fn read(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
    ) -> sluice_engine::Result<SourceRead> {
        let p: u64 = partition
            .parse()
            .ok()
            .filter(|p| *p < u64::from(self.config.partitions))
            .ok_or_else(|| {
                sluice_engine::Error::in_source(
                    &self.name,
                    format!(
                        "has no partition '{partition}' (partitions 0..{})",
                        self.config.partitions
                    ),
                )
            })?;
        let source = self.clone();
        let batch = cpu_bound(move || source.generate(p, range))
            .await
            .map_err(|e| sluice_engine::Error::in_source(&self.name, e))?;
        Ok(SourceRead {
            batches: vec![batch],
            dead_letters: Vec::new(),
        })
    }

    fn max_per_batch(&self) -> Option<u64> {
        Some(self.config.max_records_per_batch)
    }

    fn reads_may_grow_schema(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{AsArray, Int64Array};
    use arrow::datatypes::Int64Type;

    fn source(table: NexmarkTable, partitions: u32) -> NexmarkSource {
        let mut config = NexmarkSourceConfig::new(table);
        config.partitions = partitions;
        config.seed = 7;
        NexmarkSource::new(config).unwrap()
    }

    /// A generated batch holds what its rows use and no more: its text columns, sized for
    /// their longest values, are shrunk to what they hold.
    #[test]
    fn generated_batches_hold_only_what_their_rows_use() {
        for table in [
            NexmarkTable::Bid,
            NexmarkTable::Auction,
            NexmarkTable::Person,
        ] {
            let batch = source(table, 4)
                .generate(1, OffsetRange::new(0, 100_000))
                .unwrap();
            let used = sluice_engine::memory::batch_bytes(&batch);
            let held = sluice_engine::memory::held_bytes([&batch]);
            // What `generate` leaves unshrunk: a 64th of a column, and 4 KiB (its text was
            // sized a tenth or more above what it holds).
            let slack = used / 64 + 4096 * batch.num_columns();
            assert!(
                held <= used + slack,
                "{table:?}: {held} bytes held for {used} used"
            );
        }
    }

    #[test]
    fn any_offset_range_regenerates_identically() {
        for table in [
            NexmarkTable::Bid,
            NexmarkTable::Auction,
            NexmarkTable::Person,
        ] {
            let s = source(table, 3);
            let whole = s.generate(1, OffsetRange::new(0, 5_000)).unwrap();
            // The same offsets in pieces, and again later: the same rows.
            let pieces: Vec<RecordBatch> = [(0, 1_234), (1_234, 1_235), (1_235, 5_000)]
                .iter()
                .map(|(a, b)| s.generate(1, OffsetRange::new(*a, *b)).unwrap())
                .collect();
            let joined = arrow::compute::concat_batches(&whole.schema(), &pieces).unwrap();
            assert_eq!(whole, joined, "{table:?}");
            let again = source(table, 3)
                .generate(1, OffsetRange::new(0, 5_000))
                .unwrap();
            assert_eq!(whole, again);
            // Another seed gives other events.
            let mut other = NexmarkSourceConfig::new(table);
            other.partitions = 3;
            other.seed = 8;
            let other = NexmarkSource::new(other)
                .unwrap()
                .generate(1, OffsetRange::new(0, 5_000))
                .unwrap();
            assert_ne!(whole, other);
        }
    }

    #[test]
    fn text_columns_hold_little_more_than_their_values() {
        for table in [
            NexmarkTable::Bid,
            NexmarkTable::Auction,
            NexmarkTable::Person,
        ] {
            // Four partitions: the event mix's share differs between them (see `generate`);
            // partitions 1 and 3 hold no persons.
            let source = source(table, 4);
            let (mut used, mut held) = (0, 0);
            for partition in 0..4 {
                let batch = source
                    .generate(partition, OffsetRange::new(0, 100_000))
                    .unwrap();
                for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
                    if field.name() != sluice_engine::source::SOURCE_PARTITION
                        && *field.data_type() == DataType::Utf8
                    {
                        let values = column.as_string::<i32>().values();
                        used += values.len();
                        held += values.capacity();
                    }
                }
            }
            // A text builder sized below its values doubles, leaving up to half unused.
            assert!(used > 0, "{table:?}: no text generated");
            assert!(
                held as f64 <= 1.25 * used as f64,
                "{table:?}: {held} bytes allocated for {used} bytes of text"
            );
        }
    }

    #[test]
    fn the_event_mix_ids_and_skew_follow_the_standard() {
        let n = 200_000u64;
        let counts: Vec<usize> = [
            NexmarkTable::Person,
            NexmarkTable::Auction,
            NexmarkTable::Bid,
        ]
        .iter()
        .map(|t| {
            (0..4)
                .map(|p| {
                    let len = source(*t, 4).partition_len(p, n) as i64;
                    source(*t, 4)
                        .generate(p, OffsetRange::new(0, len))
                        .unwrap()
                        .num_rows()
                })
                .sum()
        })
        .collect();
        assert_eq!(counts, vec![4_000, 12_000, 184_000], "1 : 3 : 46");

        // Bids: half on the hot auction of their moment, three quarters by a hot bidder.
        let s = source(NexmarkTable::Bid, 1);
        let bids = s.generate(0, OffsetRange::new(0, n as i64)).unwrap();
        let offsets = bids.column(8).as_primitive::<Int64Type>();
        let auctions = bids.column(0).as_primitive::<Int64Type>();
        let bidders = bids.column(1).as_primitive::<Int64Type>();
        let mut hot_auction = 0;
        let mut hot_bidder = 0;
        for i in 0..bids.num_rows() {
            let e = offsets.value(i) as u64;
            let hot_a = (last_base0_auction_id(e) / HOT_AUCTION_RATIO * HOT_AUCTION_RATIO) as i64
                + FIRST_AUCTION_ID;
            let hot_b = (last_base0_person_id(e) / HOT_BIDDER_RATIO * HOT_BIDDER_RATIO + 1) as i64
                + FIRST_PERSON_ID;
            hot_auction += usize::from(auctions.value(i) == hot_a);
            hot_bidder += usize::from(bidders.value(i) == hot_b);
            // Every bid is on an auction that exists (or a few ahead: the leads).
            assert!(auctions.value(i) <= last_base0_auction_id(e) as i64 + FIRST_AUCTION_ID + 10);
        }
        let share = |k: usize| k as f64 / bids.num_rows() as f64;
        assert!(
            (share(hot_auction) - 0.5).abs() < 0.02,
            "{}",
            share(hot_auction)
        );
        assert!(
            (share(hot_bidder) - 0.75).abs() < 0.02,
            "{}",
            share(hot_bidder)
        );
        // Prices are log-uniform over 10² … 10⁸: the median is about 10⁵.
        let mut prices: Vec<i64> = bids.column(2).as_primitive::<Int64Type>().values().to_vec();
        prices.sort_unstable();
        let median = prices[prices.len() / 2] as f64;
        assert!((median.log10() - 5.0).abs() < 0.1, "{median}");
        // Event time: 100 µs apart (10 000 events/s), in order.
        let times = bids
            .column(5)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(
            times.value(1) - times.value(0),
            100 * (offsets.value(1) - offsets.value(0))
        );
        // Persons and auctions get consecutive ids.
        let people = source(NexmarkTable::Person, 1)
            .generate(0, OffsetRange::new(0, 500))
            .unwrap();
        let ids: &Int64Array = people.column(0).as_primitive();
        assert_eq!(ids.values().to_vec(), (1000..1010).collect::<Vec<_>>());
    }

    #[test]
    fn out_of_order_groups_shuffle_event_time_within_the_group() {
        let mut config = NexmarkSourceConfig::new(NexmarkTable::Bid);
        config.partitions = 1;
        config.out_of_order_group = 10;
        let s = NexmarkSource::new(config).unwrap();
        let times: Vec<i64> = (0..1_000).map(|n| s.generator.event_time(n)).collect();
        let in_order = times.windows(2).all(|w| w[0] <= w[1]);
        assert!(!in_order);
        for (n, t) in times.iter().enumerate() {
            let group_start = s.generator.base_time + (n as i64 / 10 * 10) * 100;
            assert!((group_start..group_start + 1_000).contains(t));
        }
        let mut sorted = times.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..1_000)
                .map(|n| s.generator.base_time + n * 100)
                .collect::<Vec<_>>()
        );
    }
}
