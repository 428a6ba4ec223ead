//! Servers a test owns alone, to stop, freeze and restart without touching
//! the shared stack.

/// A real redis-server of this test's own, so stopping it disturbs no other test.
pub struct PrivateRedis {
    pub port: u16,
    child: std::process::Child,
}

impl PrivateRedis {
    pub fn start(port: u16) -> PrivateRedis {
        let child = std::process::Command::new("redis-server")
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("redis-server: {e}"));
        PrivateRedis { port, child }
    }

    /// Freezes it (SIGSTOP): it keeps its connections and answers nothing.
    pub fn freeze(&self) {
        assert!(
            signal("-STOP", self.child.id()),
            "could not freeze redis-server"
        );
    }

    pub fn thaw(&self) {
        assert!(
            signal("-CONT", self.child.id()),
            "could not thaw redis-server"
        );
    }

    pub fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        // A frozen process is killed just the same.
        let _ = self.child.kill();
    }
}

/// A child process of the test's, killed (kill -9) when dropped.
pub struct Proc(pub std::process::Child);

impl Proc {
    pub fn kill9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends a signal with kill(1); whether it was delivered.
pub fn signal(sig: &str, pid: u32) -> bool {
    std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// A free port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}
