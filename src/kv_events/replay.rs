//! Lost batches asked for at an engine's replay socket: a ROUTER that
//! answers one request (`["", start_seq]`, 8 bytes big-endian) with every
//! batch it still holds from `start_seq` on, each `[..., seq, payload]`
//! (`["", topic, seq, payload]` from SGLang 0.5.23 and current vLLM; older
//! ones leave the topic out), then an end marker whose `seq` is -1. A DEALER socket reads the many answers.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// Connecting to an engine's socket gives up after this (the publisher's
/// is then tried again after a pause).
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The engine has sent everything once it is silent this long.
const IDLE: Duration = Duration::from_secs(2);
/// A whole replay gives up after this.
const DEADLINE: Duration = Duration::from_secs(30);
/// A replay larger than this is refused; one runs at a time, router-wide,
/// so replays hold at most this much.
const MAX_BYTES: usize = 64 << 20;
/// A message (one batch, or its replay) larger than this fails the
/// connection before it is buffered: the engine's publisher is read, not
/// trusted with the router's memory.
pub(super) const MAX_MESSAGE: usize = 16 << 20;
/// Answers before the one asked for that are passed over, at most.
const MAX_EARLIER: u64 = 1024;

static ONE_AT_A_TIME: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("{0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("no answer within {0:?}")]
    Silent(Duration),
    #[error("not done within {0:?}")]
    Slow(Duration),
    #[error("the engine no longer holds batch {0}")]
    Gone(u64),
    #[error("batch {got} came where {want} was due")]
    OutOfOrder { want: u64, got: u64 },
    #[error("an answer of {0} frames is not [..., seq, payload]")]
    Malformed(usize),
    #[error("more than {} MiB", MAX_BYTES >> 20)]
    TooLarge,
}

/// The payloads of batches `from..upto`, in order and all of them.
pub async fn replay(endpoint: &str, from: u64, upto: u64) -> Result<Vec<Bytes>, ReplayError> {
    let _one = ONE_AT_A_TIME.acquire().await;
    tokio::time::timeout(DEADLINE, ask(endpoint, from, upto))
        .await
        .map_err(|_| ReplayError::Slow(DEADLINE))?
}

async fn ask(endpoint: &str, from: u64, upto: u64) -> Result<Vec<Bytes>, ReplayError> {
    let mut options = SocketOptions::default();
    options.connect_timeout(CONNECT_TIMEOUT);
    options.max_message_size(MAX_MESSAGE);
    let mut dealer = DealerSocket::with_options(options);
    dealer.connect(endpoint).await?;
    let mut ask = ZmqMessage::from(Bytes::new());
    ask.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    dealer.send(ask).await?;
    let mut out = Vec::new();
    let mut bytes = 0;
    let mut earlier = 0;
    let mut want = from;
    while want < upto {
        let answer = tokio::time::timeout(IDLE, dealer.recv())
            .await
            .map_err(|_| ReplayError::Silent(IDLE))??;
        let n = answer.len();
        let (Some(seq), Some(payload)) =
            (answer.get(n.wrapping_sub(2)), answer.get(n.wrapping_sub(1)))
        else {
            return Err(ReplayError::Malformed(n));
        };
        let seq = <[u8; 8]>::try_from(seq.as_ref()).map_err(|_| ReplayError::Malformed(n))?;
        let seq = u64::from_be_bytes(seq);
        if seq == u64::MAX {
            // The end: it holds nothing more.
            return Err(ReplayError::Gone(want));
        }
        if seq < want {
            earlier += 1;
            if earlier > MAX_EARLIER {
                return Err(ReplayError::OutOfOrder { want, got: seq });
            }
            continue;
        }
        if seq > want {
            return Err(if want == from {
                ReplayError::Gone(want)
            } else {
                ReplayError::OutOfOrder { want, got: seq }
            });
        }
        bytes += payload.len().max(64);
        if bytes > MAX_BYTES {
            return Err(ReplayError::TooLarge);
        }
        out.push(payload.clone());
        want += 1;
    }
    Ok(out)
}
